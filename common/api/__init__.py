"""Conversions between the wire (protobuf) and the engine's dataclasses."""
