"""SplitFed: data parties that share one backbone at a compute party and
average their own segments through Flower (``run.run_splitfed``)."""
