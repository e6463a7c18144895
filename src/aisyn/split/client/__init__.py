"""The data party A: its session and rounds, its ranks, the split executor, and
the commands it runs (train, evaluate, generate, merge).
"""
