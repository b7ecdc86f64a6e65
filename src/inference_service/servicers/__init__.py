"""Thin gRPC servicers: proto in, one core call, proto out."""
