"""torchprime-style model recipes: model code, configs and the `train` entry point."""
