"""AIsyn: split and federated training of PanGu-alpha across organisations."""

__version__ = "0.1.0"
