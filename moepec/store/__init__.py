"""The two tiers and the commit: RAM snapshots, DCP storage on fsspec, manifests, persist."""
