"""Generated protobuf/gRPC modules for tensor_link.proto (scripts/gen_protos.sh)."""
