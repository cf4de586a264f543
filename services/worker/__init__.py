"""What prefill and decode workers share: the engine, the gRPC server, registration."""
