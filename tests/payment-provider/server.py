#!/usr/bin/env python3
"""A small payment provider for idemflow's test suite.

idemflow's HTTP outbox effect calls an external API with an Idempotency-Key header, so that a call repeated after
a crash, a timeout or a lost answer charges once. This server is that API, honouring the key as the IETF httpapi
working group's draft "The Idempotency-Key HTTP Header Field" (draft-ietf-httpapi-idempotency-key-header,
https://datatracker.ietf.org/doc/draft-ietf-httpapi-idempotency-key-header/) describes: the server
fingerprints each request (here sha256 of method, path and body), remembers the response it gave for a key and
answers a repeat with it, and answers the draft's error cases with RFC 9457 problem details (application/problem+json):
  no key                                   400 Bad Request
  a request with the key is still going    409 Conflict
  the key reused with another request      422 Unprocessable Content
A request with an unknown key "charges": it gets the next charge id and 201 Created with
{"charge_id": N, "idempotency_key": KEY, "request": <its body, as JSON when it parses, else text>}; a repeat of it
gets the same status and body again, with Idempotent-Replayed: true. Any method and any path outside /_test/ is
such a request. No payment provider runs on the test machines (and a sandbox would not let tests lose answers
on purpose), so the suite runs this one; it counts what it saw, so a test can assert "one charge per key".

Also, for the tests:
  --header NAME                 the key's header (default Idempotency-Key)
  POST   /_test/faults RULE     queue a fault rule (a JSON object, or an array of them); the rules apply in the
                                order queued, each to the next "count" requests that carry a key ("count" -1:
                                until cleared; default 1), before the idempotency logic:
           {"status": 503, "count": 3, "retry_after": 2}   answer that status (problem+json, Retry-After when
                                                           given) without charging: the key stays unknown
           {"delay": 5.0, "count": 1}                      process the request (charge), the key in flight, then
                                                           sleep that many seconds before answering
           {"reset": true, "count": 1}                     close the connection with a TCP reset, no answer, the
                                                           request not processed ("after_charge": true: processed
                                                           first, so the client never learns the charge succeeded)
                                Any rule may have "path": a prefix of the request's path (its query left out); it
                                then applies only to requests under it (one merchant's account, one tenant's host),
                                and the others pass it by
  GET    /_test/faults          the rules still queued
  DELETE /_test/faults          clear every rule
  GET    /_test/state           {"requests", "charges", "distinct_keys", "replays", "conflicts", "mismatches",
                                 "keys": {KEY: {"charges", "replays", "requests", "path", "headers", "body"}}}
                                (path, lowercased headers and body of the request that charged; of the latest
                                request while the key has no charge), and "log": every request outside /_test/, in
                                order: {"method", "path", "headers"} (the request line's target and every header,
                                lowercased), so a test sees where each request went and what it carried
  POST   /_test/reset           forget everything: keys, counters, charge ids, faults
Speaks HTTP/1.1 with keep-alive. Prints "listening on PORT" once it accepts connections.
"""

import argparse
import hashlib
import json
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PROBLEM_TYPE = "https://datatracker.ietf.org/doc/draft-ietf-httpapi-idempotency-key-header/"

LOCK = threading.Lock()
STATE = {}
KEYS = {}  # key -> {"state": "in_flight" | "done", "fingerprint", "status", "response", counters, the request}
FAULTS = []  # the queued rules: {"status" | "delay" | "reset", "count", "retry_after", "after_charge"}


def forget():
    """Resets everything (the caller holds LOCK, or nothing else runs yet)."""
    STATE.clear()
    STATE.update(requests=0, charges=0, replays=0, conflicts=0, mismatches=0, next_charge=1, log=[])
    KEYS.clear()
    del FAULTS[:]


def parse_rule(rule):
    """A fault rule checked and normalized; ValueError when it is not one."""
    if not isinstance(rule, dict):
        raise ValueError("a rule is a JSON object")
    kinds = [k for k in ("status", "delay", "reset") if k in rule]
    if len(kinds) != 1:
        raise ValueError('a rule has exactly one of "status", "delay", "reset"')
    count = rule.get("count", 1)
    if not isinstance(count, int) or count < -1 or count == 0:
        raise ValueError('"count" is a positive integer or -1')
    out = {"count": count}
    if "path" in rule:
        if not isinstance(rule["path"], str) or not rule["path"].startswith("/"):
            raise ValueError('"path" is a path prefix, starting with /')
        out["path"] = rule["path"]
    if "status" in rule:
        status = rule["status"]
        if not isinstance(status, int) or not 100 <= status <= 599:
            raise ValueError('"status" is an HTTP status code')
        out["status"] = status
        retry_after = rule.get("retry_after")
        if retry_after is not None:
            out["retry_after"] = retry_after if isinstance(retry_after, str) else str(int(retry_after))
    elif "delay" in rule:
        if not isinstance(rule["delay"], (int, float)) or rule["delay"] < 0:
            raise ValueError('"delay" is a number of seconds')
        out["delay"] = float(rule["delay"])
    else:
        if rule["reset"] is not True:
            raise ValueError('"reset" is true')
        out["reset"] = True
        out["after_charge"] = bool(rule.get("after_charge", False))
    return out


def next_fault(path):
    """The first queued rule that applies to a request for `path` (no "path" of its own, or a prefix of it),
    counted (the caller holds LOCK); None when none does."""
    path = path.split("?")[0]
    for i, rule in enumerate(FAULTS):
        if not path.startswith(rule.get("path", "")):
            continue
        if rule["count"] > 0:
            rule["count"] -= 1
            if rule["count"] == 0:
                FAULTS.pop(i)
        return dict(rule)
    return None


def decode(body):
    """The body as JSON when it parses, else as text."""
    text = body.decode("utf-8", "replace")
    try:
        return json.loads(text)
    except ValueError:
        return text


def problem(status, title, detail):
    return status, {"type": PROBLEM_TYPE, "title": title, "status": status, "detail": detail}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    key_header = "Idempotency-Key"

    def log_message(self, *args):
        pass

    def send(self, status, data, content_type="application/json", headers=()):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def answer(self, status, body, headers=()):
        self.send(status, json.dumps(body).encode(), headers=headers)

    def answer_problem(self, status, body, headers=()):
        self.send(status, json.dumps(body).encode(), "application/problem+json", headers)

    def read_body(self):
        """The request's body: Content-Length bytes, or the chunks of a chunked one."""
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def reset_connection(self):
        """Closes the connection with a TCP reset (SO_LINGER on with a 0 s timeout), no answer."""
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.rfile.close()  # its reference would keep the socket open past close()
            self.connection.close()
        except OSError:
            pass

    def dispatch(self):
        try:
            body = self.read_body()
        except ValueError:
            self.close_connection = True
            return self.answer_problem(*problem(400, "Bad request body", "A malformed Content-Length or chunk."))
        if self.path.startswith("/_test/"):
            return self.test_endpoint(body)
        try:
            self.ordinary(body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client left (its timeout during a delay)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = dispatch

    def ordinary(self, body):
        key = self.headers.get(self.key_header)
        headers = {}
        for name, value in self.headers.items():
            name = name.lower()
            headers[name] = headers[name] + ", " + value if name in headers else value
        request = {"path": self.path, "headers": headers, "body": decode(body)}
        with LOCK:
            STATE["log"].append({"method": self.command, "path": self.path, "headers": headers})
        fingerprint = hashlib.sha256(self.command.encode() + b" " + self.path.encode() + b"\n" + body).hexdigest()
        with LOCK:
            STATE["requests"] += 1
            if key is None:
                missing = True
            else:
                missing = False
                entry = KEYS.setdefault(key, {"state": None, "charges": 0, "replays": 0, "requests": 0})
                entry["requests"] += 1
                if entry["charges"] == 0:
                    entry.update(request)
                rule = next_fault(self.path) or {}
                delay = rule.get("delay", 0.0)
                reset = rule.get("reset", False)
                if "status" in rule or (reset and not rule["after_charge"]):
                    outcome = None  # not processed
                elif entry["state"] is None:
                    entry.update(request, state="in_flight", fingerprint=fingerprint)
                    entry["charges"] += 1
                    charge = STATE["next_charge"]
                    STATE["next_charge"] += 1
                    STATE["charges"] += 1
                    response = {"charge_id": charge, "idempotency_key": key, "request": request["body"]}
                    entry["status"], entry["response"] = 201, json.dumps(response).encode()
                    if not delay:
                        entry["state"] = "done"
                    outcome = ("charged", entry["status"], entry["response"])
                elif entry["state"] == "in_flight":
                    STATE["conflicts"] += 1
                    outcome = ("problem",) + problem(
                        409, "A request is outstanding for this %s" % self.key_header,
                        "A request with the same %s is being processed; retry later." % self.key_header)
                elif entry["fingerprint"] == fingerprint:
                    entry["replays"] += 1
                    STATE["replays"] += 1
                    outcome = ("replayed", entry["status"], entry["response"])
                else:
                    STATE["mismatches"] += 1
                    outcome = ("problem",) + problem(
                        422, "%s is already used" % self.key_header,
                        "This %s was used with another request (method, path or body)." % self.key_header)
        if missing:
            return self.answer_problem(*problem(
                400, "%s is missing" % self.key_header,
                "This operation is idempotent and requires the %s request header." % self.key_header))
        if "status" in rule:
            extra = [("Retry-After", rule["retry_after"])] if "retry_after" in rule else []
            return self.answer_problem(*problem(rule["status"], "Injected failure", "A fault rule answered."), extra)
        if delay:
            time.sleep(delay)
            if outcome[0] == "charged":
                with LOCK:
                    entry["state"] = "done"
        if reset:
            return self.reset_connection()
        kind, status, response = outcome
        if kind == "problem":
            return self.answer_problem(status, response)
        extra = [("Idempotent-Replayed", "true")] if kind == "replayed" else []
        self.send(status, response, headers=extra)

    def test_endpoint(self, body):
        path = self.path.split("?")[0]
        with LOCK:
            if path == "/_test/faults" and self.command == "POST":
                try:
                    rules = json.loads(body or b"null")
                    rules = [parse_rule(r) for r in (rules if isinstance(rules, list) else [rules])]
                except ValueError as e:
                    return self.answer_problem(*problem(400, "Not a fault rule", str(e)))
                FAULTS.extend(rules)
                return self.answer(200, FAULTS)
            if path == "/_test/faults" and self.command == "GET":
                return self.answer(200, FAULTS)
            if path == "/_test/faults" and self.command == "DELETE":
                del FAULTS[:]
                return self.answer(200, FAULTS)
            if path == "/_test/reset" and self.command == "POST":
                forget()
                return self.answer(200, {})
            if path == "/_test/state" and self.command == "GET":
                keys = {k: {f: e.get(f) for f in ("charges", "replays", "requests", "path", "headers", "body")}
                        for k, e in KEYS.items()}
                state = {f: STATE[f] for f in ("requests", "charges", "replays", "conflicts", "mismatches")}
                state["distinct_keys"] = sum(1 for e in KEYS.values() if e["charges"] > 0)
                state["keys"] = keys
                state["log"] = STATE["log"]
                return self.answer(200, state)
        self.answer_problem(*problem(404, "Not found", "No test endpoint %s %s." % (self.command, path)))


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--header", default="Idempotency-Key", help="the idempotency key's header")
    args = parser.parse_args()
    Handler.key_header = args.header
    forget()
    server = Server(("127.0.0.1", args.port), Handler)
    print("listening on %d" % args.port, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
