"""Reading checkpoints back: stitching views, recovery records, offline inspect/verify/export."""
