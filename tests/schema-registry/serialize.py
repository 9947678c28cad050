#!/usr/bin/env python3
"""Encodes records as a producer would, with confluent-kafka's own serializers (PyPI).

    serialize.py REGISTRY_URL FORMAT TOPIC SCHEMA_FILE [USER:PASSWORD]

FORMAT is avro or json_schema. Reads one JSON document per line on standard input and prints each encoded value in
the schema registry's wire format, as hex, one per line. The serializer registers SCHEMA_FILE's schema under the
subject TOPIC-value (the default topic name strategy), as a producer's does. In the JSON, numbers with a fraction
are read as Python Decimals (what the Avro serializer takes for `decimal`), and {"$bytes": "<hex>"} as bytes.
"""

import decimal
import json
import sys

from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.serialization import MessageField, SerializationContext


def as_bytes(obj):
    return bytes.fromhex(obj["$bytes"]) if list(obj) == ["$bytes"] else obj


def main():
    url, fmt, topic, schema_file = sys.argv[1:5]
    conf = {"url": url}
    if len(sys.argv) > 5:
        conf["basic.auth.user.info"] = sys.argv[5]
    client = SchemaRegistryClient(conf)
    schema = open(schema_file).read()
    if fmt == "avro":
        from confluent_kafka.schema_registry.avro import AvroSerializer
        serializer = AvroSerializer(client, schema, conf={"auto.register.schemas": True})
    elif fmt == "json_schema":
        from confluent_kafka.schema_registry.json_schema import JSONSerializer
        serializer = JSONSerializer(schema, client, conf={"auto.register.schemas": True})
    else:
        sys.exit("unknown format %r" % fmt)
    ctx = SerializationContext(topic, MessageField.VALUE)
    for line in sys.stdin:
        if line.strip():
            value = json.loads(line, parse_float=decimal.Decimal, object_hook=as_bytes)
            print(serializer(value, ctx).hex(), flush=True)


if __name__ == "__main__":
    main()
