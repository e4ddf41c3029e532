"""Training: the one-node step (`train_step`) and a step's compiled memory (`memory_report`)."""
