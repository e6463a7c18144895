"""What the experiments run on: presets (``presets``) and the base model and
data they cache (``inputs``), shared by ``experiments`` and ``privacy``."""
