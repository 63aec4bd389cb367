"""The storage tier and the commit: DCP storage on fsspec, manifests, the lease, persist."""
