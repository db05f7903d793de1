"""The RabbitMQ e2e tests' independent side: Python's pika (not walbox's
AMQP client) declares the queues consumers would bind and reads them back.

  amqp_queues.py bind URL EXCHANGE      stdin: {"queue": "routing key", ...}
      declares the exchange (topic, durable) and each queue (durable),
      bound with its routing key
  amqp_queues.py read URL               stdin: ["queue", ...]
      stdout: [{"queue", "routing_key", "message_id", "headers", "body",
                "body_hex", "delivery_mode"}, ...], every message of each
      queue in queue order (taken off the queues); "body" is the body as
      UTF-8 (null when it is not), "body_hex" its bytes
  amqp_queues.py publish URL EXCHANGE   stdin: {"routing_key", "headers", "body"}
      publishes one persistent message, confirmed
"""

import json
import sys

import pika


def text(body):
    try:
        return body.decode()
    except UnicodeDecodeError:
        return None


def main():
    action, url = sys.argv[1], sys.argv[2]
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    if action == "bind":
        exchange = sys.argv[3]
        channel.exchange_declare(exchange=exchange, exchange_type="topic", durable=True)
        for queue, key in json.load(sys.stdin).items():
            channel.queue_declare(queue=queue, durable=True)
            channel.queue_bind(queue=queue, exchange=exchange, routing_key=key)
        json.dump({}, sys.stdout)
    elif action == "read":
        out = []
        for queue in json.load(sys.stdin):
            while True:
                method, properties, body = channel.basic_get(queue=queue, auto_ack=True)
                if method is None:
                    break
                headers = {
                    k: (v.decode() if isinstance(v, bytes) else v)
                    for k, v in (properties.headers or {}).items()
                }
                out.append(
                    {
                        "queue": queue,
                        "routing_key": method.routing_key,
                        "message_id": properties.message_id,
                        "headers": headers,
                        "body": text(body),
                        "body_hex": body.hex(),
                        "delivery_mode": properties.delivery_mode,
                    }
                )
        json.dump(out, sys.stdout)
    elif action == "publish":
        m = json.load(sys.stdin)
        channel.confirm_delivery()
        channel.basic_publish(
            exchange=sys.argv[3],
            routing_key=m["routing_key"],
            body=m["body"].encode(),
            properties=pika.BasicProperties(headers=m["headers"], delivery_mode=2),
        )
        json.dump({}, sys.stdout)
    else:
        sys.exit(f"unknown action {action}")
    connection.close()


if __name__ == "__main__":
    main()
