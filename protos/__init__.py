"""gRPC contracts between the services."""
