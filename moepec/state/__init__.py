"""What the training state is: experts of a model, the catalogue of keys, each rank's share."""
