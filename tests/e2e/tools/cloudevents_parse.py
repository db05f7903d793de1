"""Parses Kafka records as CloudEvents with the CloudEvents Python SDK, as a
consumer would: one JSON record per input line ({"headers": {name: text},
"key": text or null, "value": text or null}), one JSON line out per record
with the event's attributes and data, or {"error": "..."} when the SDK
refuses the record."""

import json
import sys

from cloudevents.core.bindings.kafka import KafkaMessage, from_kafka
from cloudevents.core.formats.json import JSONFormat

for line in sys.stdin:
    record = json.loads(line)
    message = KafkaMessage(
        headers={k: v.encode() for k, v in record["headers"].items()},
        key=None if record["key"] is None else record["key"].encode(),
        value=b"" if record["value"] is None else record["value"].encode(),
    )
    try:
        event = from_kafka(message, JSONFormat())
        attributes = {
            k: (v.isoformat() if hasattr(v, "isoformat") else v)
            for k, v in event.get_attributes().items()
        }
        print(json.dumps({"attributes": attributes, "data": event.get_data()}))
    except Exception as e:  # the SDK's refusal, reported to the test
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
