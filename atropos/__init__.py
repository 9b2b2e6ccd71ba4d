"""atropos-sandbox: isolated, stateful sandbox slots for RL of tool-using LLM agents."""

__version__ = "0.1.0"
