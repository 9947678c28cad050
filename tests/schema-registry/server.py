#!/usr/bin/env python3
"""A small schema registry for idemflow's test suite.

It serves the documented REST endpoints of Confluent's Schema Registry that serializers and idemflow call
(https://docs.confluent.io/platform/current/schema-registry/develop/api.html): schemas by id, subjects and their
versions, registration and lookup, with the documented error codes (40401 subject not found, 40402 version not
found, 40403 schema not found). No registry server installs on the test machines (Confluent's and Apicurio's are
Java programs that no reachable registry distributes, Karapace is not on PyPI), so the suite runs this one, and the
ecosystem's own serializers (confluent-kafka's) register their schemas in it.

A Protobuf schema registered in its serialized form (a base64 FileDescriptorProto, as confluent-kafka's
ProtobufSerializer registers it) is kept as .proto text, as Confluent's registry keeps it, and served as text; as
the serialized form only with ?format=serialized.

Also, for the tests:
  --user USER:PASSWORD   basic authentication required (401 otherwise)
  --bearer TOKEN         bearer authentication required (401 otherwise)
  --tls CERT KEY         HTTPS with this certificate and key
  POST /_test/fail {"status": 503, "count": 5}    the next 5 requests answer 503 ("count" -1: until cleared)
  POST /_test/fail {"status": 0}                  answer normally again
  POST /_test/redirect {"location": "http://..."}  every other request answers 307 to that base URL plus its path
  POST /_test/redirect {"location": ""}            answer normally again
  GET  /_test/requests                             how many requests each path had
Prints "listening on PORT" once it accepts connections.
"""

import argparse
import base64
import json
import re
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()
SCHEMAS = []  # index + 1 is the id: {"schema", "schemaType", "references"}
SUBJECTS = {}  # subject -> [id of version 1, id of version 2, ...]
FAIL = {"status": 0, "count": 0}
REDIRECT = {"location": ""}
REQUESTS = {}


SCALARS = {1: "double", 2: "float", 3: "int64", 4: "uint64", 5: "int32", 6: "fixed64", 7: "fixed32", 8: "bool",
           9: "string", 12: "bytes", 13: "uint32", 15: "sfixed32", 16: "sfixed64", 17: "sint32", 18: "sint64"}


def proto_text(serialized):
    """The .proto text of a base64 FileDescriptorProto (messages, enums, nested types, maps, oneofs, optional)."""
    from google.protobuf import descriptor_pb2
    fd = descriptor_pb2.FileDescriptorProto.FromString(base64.b64decode(serialized))
    proto3 = fd.syntax == "proto3"
    out = ['syntax = "%s";' % (fd.syntax or "proto2")]
    if fd.package:
        out.append("package %s;" % fd.package)
    out += ['import "%s";' % d for d in fd.dependency]

    def type_of(f, nested):
        if f.type in (11, 14):
            entry = nested.get(f.type_name.rsplit(".", 1)[-1])
            if entry is not None and entry.options.map_entry:
                k, v = entry.field[0], entry.field[1]
                return "map<%s, %s>" % (type_of(k, {}), type_of(v, {}))
            return f.type_name
        return SCALARS[f.type]

    def field(f, nested, indent):
        t = type_of(f, nested)
        label = ""
        if not t.startswith("map<"):
            if f.label == 3:
                label = "repeated "
            elif f.label == 2:
                label = "required "
            elif f.proto3_optional or not proto3:
                label = "optional "
        return "%s%s%s %s = %d;" % (indent, label, t, f.name, f.number)

    def enum(e, indent):
        lines = ["%senum %s {" % (indent, e.name)]
        lines += ["%s  %s = %d;" % (indent, v.name, v.number) for v in e.value]
        return lines + [indent + "}"]

    def message(m, indent):
        lines = ["%smessage %s {" % (indent, m.name)]
        nested = {n.name: n for n in m.nested_type}
        for n in m.nested_type:
            if not n.options.map_entry:
                lines += message(n, indent + "  ")
        for e in m.enum_type:
            lines += enum(e, indent + "  ")
        real_oneofs = {i for i, _ in enumerate(m.oneof_decl)
                       if not all(f.proto3_optional for f in m.field if f.HasField("oneof_index") and f.oneof_index == i)}
        done = set()
        for f in m.field:
            if f.HasField("oneof_index") and f.oneof_index in real_oneofs:
                if f.oneof_index not in done:
                    done.add(f.oneof_index)
                    lines.append("%s  oneof %s {" % (indent, m.oneof_decl[f.oneof_index].name))
                    for g in m.field:
                        if g.HasField("oneof_index") and g.oneof_index == f.oneof_index:
                            lines.append(field(g, nested, indent + "    ").replace("optional ", ""))
                    lines.append(indent + "  }")
            else:
                lines.append(field(f, nested, indent + "  "))
        return lines + [indent + "}"]

    for m in fd.message_type:
        out += message(m, "")
    for e in fd.enum_type:
        out += enum(e, "")
    return "\n".join(out) + "\n"


def canonical(body):
    schema = body.get("serialized", body["schema"])
    return (body.get("schemaType", "AVRO"), schema, json.dumps(body.get("references", []), sort_keys=True))


def entry(schema_id, serialized=False):
    s = SCHEMAS[schema_id - 1]
    out = {"schema": s.get("serialized", s["schema"]) if serialized else s["schema"]}
    if s["schemaType"] != "AVRO":
        out["schemaType"] = s["schemaType"]
    if s["references"]:
        out["references"] = s["references"]
    return out


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    auth = None

    def log_message(self, *args):
        pass

    def answer(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def error(self, status, code, message):
        self.answer(status, {"error_code": code, "message": message})

    def body(self):
        n = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(n) or b"{}")

    def gate(self):
        """Counts the request, applies an injected failure and the authentication. True when it may go on."""
        path = self.path.split("?")[0]
        with LOCK:
            REQUESTS[path] = REQUESTS.get(path, 0) + 1
            if path.startswith("/_test/"):
                return True
            if FAIL["status"] and FAIL["count"] != 0:
                FAIL["count"] -= 1 if FAIL["count"] > 0 else 0
                status = FAIL["status"]
                if FAIL["count"] == 0:
                    FAIL["status"] = 0
                self.error(status, status * 100 + 1 if status < 1000 else status, "injected failure")
                return False
            if REDIRECT["location"]:
                self.send_response(307)
                self.send_header("Location", REDIRECT["location"].rstrip("/") + self.path)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return False
        if self.auth is not None and self.headers.get("Authorization") != self.auth:
            self.error(401, 401, "Unauthorized")
            return False
        return True

    def do_GET(self):
        if not self.gate():
            return
        path = self.path.split("?")[0]
        with LOCK:
            if path == "/_test/requests":
                return self.answer(200, REQUESTS)
            if path in ("/config", "/config/"):
                return self.answer(200, {"compatibilityLevel": "BACKWARD"})
            if path == "/schemas/types":
                return self.answer(200, ["AVRO", "JSON", "PROTOBUF"])
            if path == "/subjects":
                return self.answer(200, sorted(SUBJECTS))
            m = re.fullmatch(r"/schemas/ids/(\d+)(/versions|/subjects)?", path)
            if m:
                sid = int(m.group(1))
                if not 1 <= sid <= len(SCHEMAS):
                    return self.error(404, 40403, "Schema %d not found" % sid)
                if m.group(2):
                    pairs = [(s, v + 1) for s, ids in SUBJECTS.items() for v, i in enumerate(ids) if i == sid]
                    if m.group(2) == "/subjects":
                        return self.answer(200, sorted({s for s, _ in pairs}))
                    return self.answer(200, [{"subject": s, "version": v} for s, v in pairs])
                return self.answer(200, entry(sid, "format=serialized" in self.path))
            m = re.fullmatch(r"/subjects/([^/]+)/versions(?:/([^/]+))?", path)
            if m:
                subject = unquote(m.group(1))
                if subject not in SUBJECTS:
                    return self.error(404, 40401, "Subject '%s' not found." % subject)
                ids = SUBJECTS[subject]
                if m.group(2) is None:
                    return self.answer(200, list(range(1, len(ids) + 1)))
                version = len(ids) if m.group(2) in ("latest", "-1") else int(m.group(2))
                if not 1 <= version <= len(ids):
                    return self.error(404, 40402, "Version %s not found." % m.group(2))
                sid = ids[version - 1]
                return self.answer(200, dict(entry(sid), subject=subject, version=version, id=sid))
        self.error(404, 404, "HTTP 404 Not Found")

    def do_POST(self):
        if not self.gate():
            return
        path = self.path.split("?")[0]
        body = self.body()
        with LOCK:
            if path == "/_test/fail":
                FAIL["status"] = int(body.get("status", 0))
                FAIL["count"] = int(body.get("count", -1))
                return self.answer(200, FAIL)
            if path == "/_test/redirect":
                REDIRECT["location"] = body.get("location", "")
                return self.answer(200, REDIRECT)
            m = re.fullmatch(r"/subjects/([^/]+)(/versions)?", path)
            if not m:
                return self.error(404, 404, "HTTP 404 Not Found")
            subject = unquote(m.group(1))
            key = canonical(body)
            existing = [i + 1 for i, s in enumerate(SCHEMAS) if canonical(s) == key]
            if m.group(2) is None:  # lookup
                ids = SUBJECTS.get(subject)
                if ids is None:
                    return self.error(404, 40401, "Subject '%s' not found." % subject)
                for v, sid in enumerate(ids):
                    if existing and sid == existing[0]:
                        return self.answer(200, dict(entry(sid), subject=subject, version=v + 1, id=sid))
                return self.error(404, 40403, "Schema not found")
            if existing:
                sid = existing[0]
            else:
                entry_ = {"schema": body["schema"], "schemaType": body.get("schemaType", "AVRO"),
                          "references": body.get("references", [])}
                if entry_["schemaType"] == "PROTOBUF" and "{" not in body["schema"]:
                    entry_["serialized"] = body["schema"]
                    entry_["schema"] = proto_text(body["schema"])
                SCHEMAS.append(entry_)
                sid = len(SCHEMAS)
            ids = SUBJECTS.setdefault(subject, [])
            if sid not in ids:
                ids.append(sid)
            return self.answer(200, {"id": sid})


def unquote(s):
    from urllib.parse import unquote as u
    return u(s)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--user")
    parser.add_argument("--bearer")
    parser.add_argument("--tls", nargs=2, metavar=("CERT", "KEY"))
    args = parser.parse_args()
    if args.user:
        Handler.auth = "Basic " + base64.b64encode(args.user.encode()).decode()
    if args.bearer:
        Handler.auth = "Bearer " + args.bearer
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    if args.tls:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(args.tls[0], args.tls[1])
        server.socket = context.wrap_socket(server.socket, server_side=True)
    print("listening on %d" % args.port, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
