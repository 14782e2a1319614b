"""What another host can do to a Ray node, run as its own process there
(tests/cluster/test_cluster_security.py runs it with `ip netns exec`); prints one
JSON object.

    python tests/support/ray_probe.py job HOST MARKER [TOKEN_FILE]   POST a job that writes MARKER: the HTTP status
    python tests/support/ray_probe.py gcs HOST:PORT [TOKEN_FILE]     the GCS's answer to GetClusterId: a gRPC status
    python tests/support/ray_probe.py nodes HOST:PORT TOKEN_FILE     the nodes the GCS counts alive
    python tests/support/ray_probe.py open HOST PORT...              per port, what answered without a token
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc

JOB_AGENT_PORT = 52365  # Ray's dashboard agent: the job API the attacker used
# One method of each gRPC service a Ray node serves: none may answer without the token.
GRPC_METHODS = ("/ray.rpc.NodeInfoGcsService/GetClusterId", "/ray.rpc.NodeManagerService/GetNodeStats",
                "/ray.rpc.CoreWorkerService/GetCoreWorkerStats", "/ray.rpc.ReporterService/GetTraceback",
                "/ray.rpc.RayletDriver/ClusterInfo", "/ray.rpc.ObjectManagerService/Pull")
HTTP_PATHS = ("/metrics", "/api/version", "/api/jobs/", "/api/job_agent/jobs/")


def bearer(token_file: str | None) -> dict[str, str]:
    return {"Authorization": "Bearer " + Path(token_file).read_text().strip()} if token_file else {}


def http(url: str, headers: dict[str, str], body: bytes | None = None) -> int | str:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **headers},
                                     method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except Exception as e:  # not HTTP at all (a gRPC port), or nothing there
        return type(e).__name__


def rpc(address: str, method: str, token_file: str | None = None) -> str:
    metadata = [("authorization", bearer(token_file)["Authorization"])] if token_file else None
    with grpc.insecure_channel(address) as channel:
        try:
            channel.unary_unary(method)(b"", timeout=10, metadata=metadata)
            return "OK"
        except grpc.RpcError as e:
            return e.code().name


def job(host: str, marker: str, token_file: str | None = None) -> dict:
    body = json.dumps({"entrypoint": f"id > {marker}"}).encode()
    return {"status": http(f"http://{host}:{JOB_AGENT_PORT}/api/job_agent/jobs/", bearer(token_file), body)}


def nodes(address: str, token_file: str) -> dict:
    from ray.core.generated import gcs_service_pb2

    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary("/ray.rpc.NodeInfoGcsService/GetAllNodeInfo",
                                   request_serializer=gcs_service_pb2.GetAllNodeInfoRequest.SerializeToString,
                                   response_deserializer=gcs_service_pb2.GetAllNodeInfoReply.FromString)
        reply = call(gcs_service_pb2.GetAllNodeInfoRequest(), timeout=10,
                     metadata=[("authorization", bearer(token_file)["Authorization"])])
    return {"alive": sorted(n.node_manager_address for n in reply.node_info_list if n.state == 0)}


def open_ports(host: str, ports: list[int]) -> dict:
    """Per port, each request that succeeded with no token (none should)."""
    found = {}
    for port in ports:
        answered = [f"GET {p}" for p in HTTP_PATHS if http(f"http://{host}:{port}{p}", {}) == 200]
        answered += [m for m in GRPC_METHODS if rpc(f"{host}:{port}", m) == "OK"]
        found[str(port)] = answered
    return found


def main(argv: list[str]) -> dict:
    command, args = argv[0], argv[1:]
    if command == "job":
        return job(*args)
    if command == "gcs":
        return {"status": rpc(args[0], "/ray.rpc.NodeInfoGcsService/GetClusterId", *args[1:])}
    if command == "nodes":
        return nodes(*args)
    if command == "open":
        return open_ports(args[0], [int(p) for p in args[1:]])
    raise SystemExit(f"unknown probe {command!r}")


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
