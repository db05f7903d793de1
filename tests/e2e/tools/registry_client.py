"""The schema-registry e2e tests' independent side: Confluent's own Python
client (confluent-kafka's SchemaRegistryClient, AvroDeserializer with
fastavro, JSONDeserializer with jsonschema) against the same registry walbox
serializes with.

  registry_client.py register URL TYPE   stdin: {"subject": "<schema>", ...}
                                         stdout: {"subject": id, ...}
  registry_client.py decode URL TYPE     stdin: [{"topic": T, "value": hex}, ...]
                                         stdout: [{"schema_id": id, "value": {...}}, ...]

TYPE is AVRO or JSON. `decode` reads each value as Confluent's deserializer
does: the magic byte, the schema id, the writer's schema fetched from the
registry by that id, then the Avro datum, or the JSON validated against the
JSON Schema; a value it cannot read fails the tool.
"""

import json
import struct
import sys

from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.schema_registry.json_schema import JSONDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext


def main():
    action, url, schema_type = sys.argv[1], sys.argv[2], sys.argv[3]
    client = SchemaRegistryClient({"url": url})
    if action == "register":
        schemas = json.load(sys.stdin)
        ids = {
            subject: client.register_schema(subject, Schema(text, schema_type))
            for subject, text in schemas.items()
        }
        json.dump(ids, sys.stdout)
    elif action == "decode":
        if schema_type == "AVRO":
            deserializer = AvroDeserializer(client)
        else:
            deserializer = JSONDeserializer(None, schema_registry_client=client)
        out = []
        for record in json.load(sys.stdin):
            value = bytes.fromhex(record["value"])
            magic, schema_id = struct.unpack(">bI", value[:5])
            assert magic == 0, f"magic byte {magic}"
            ctx = SerializationContext(record["topic"], MessageField.VALUE)
            out.append({"schema_id": schema_id, "value": deserializer(value, ctx)})
        json.dump(out, sys.stdout, default=str)
    else:
        sys.exit(f"unknown action {action}")


if __name__ == "__main__":
    main()
