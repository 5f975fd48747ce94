"""Processes around common/: the command line, and later the gateway and workers."""
