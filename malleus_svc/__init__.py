"""malleus-svc: elastic, straggler-resilient hybrid-parallel training on Ray."""
__version__ = "0.1.0"
