"""Reading checkpoints back: the restore procedure, stitching views, recovery records,
offline inspect/verify/export."""
