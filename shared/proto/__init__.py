"""Protobuf/gRPC contracts: one source (the .proto files here), code generated at build time.

`python -m shared.proto.build` (run by `make setup`) writes *_pb2.py, *_pb2.pyi and *_pb2_grpc.py next
to the .proto files; they are git-ignored and never edited or copied by hand.
"""
