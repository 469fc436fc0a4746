#!/usr/bin/python3
"""A client we did not write (python3-grpcio) calling Meridian's coordinator service.

Sends Coordinator/Register with a hand-encoded RegisterRequest and prints the gRPC status code name
(OK, UNAVAILABLE, PERMISSION_DENIED, ...). Used by the integration tests; exit status 0 unless the script
itself is misused.
  foreign_client.py TARGET SITE [--ca CA] [--cert CERT --key KEY] [--version N]
"""
import argparse
import sys

import grpc


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def register_request(version, site):
    s = site.encode()
    return b"\x08" + varint(version) + b"\x12" + varint(len(s)) + s


def main():
    p = argparse.ArgumentParser()
    p.add_argument("target")
    p.add_argument("site")
    p.add_argument("--ca")
    p.add_argument("--cert")
    p.add_argument("--key")
    p.add_argument("--version", type=int, default=2)  # core/version.h: kProtocolVersion
    a = p.parse_args()
    root = open(a.ca, "rb").read() if a.ca else None
    key = open(a.key, "rb").read() if a.key else None
    cert = open(a.cert, "rb").read() if a.cert else None
    creds = grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=cert)
    channel = grpc.secure_channel(a.target, creds, options=(("grpc.ssl_target_name_override", "coordinator"),))
    call = channel.unary_unary("/meridian.v1.Coordinator/Register",
                               request_serializer=lambda b: b, response_deserializer=lambda b: b)
    try:
        call(register_request(a.version, a.site), timeout=5)
        print("OK")
    except grpc.RpcError as e:
        print(e.code().name)
        print(e.details(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
