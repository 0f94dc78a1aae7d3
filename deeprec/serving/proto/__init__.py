"""The Open Inference Protocol's gRPC definition (grpc_service.proto) and the modules generated from it."""
