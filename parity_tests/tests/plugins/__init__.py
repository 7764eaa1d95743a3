"""Plugins the plugin tests load by path: correct ones and one for each way of getting the protocol wrong."""
