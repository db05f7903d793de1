"""The SQS e2e tests' independent side: boto3 (not walbox's AWS SDK client)
creates the queues and reads them back, against an SQS endpoint (moto's
server in the tests; any SQS works).

  sqs_queues.py create ENDPOINT NAME [ATTRIBUTE=VALUE ...]
      creates queue NAME (FifoQueue=true for a .fifo name); stdout: its URL
  sqs_queues.py count ENDPOINT URL
      stdout: the queue's ApproximateNumberOfMessages (nothing taken off)
  sqs_queues.py read ENDPOINT URL
      stdout: [{"body", "message_id", "attributes", "group", "dedup", "sequence"}, ...],
      every message of the queue in the order SQS hands them out (taken
      off the queue: each received batch is deleted); string attributes as
      text, binary ones as {"binary": base64}
"""

import base64
import json
import sys

import boto3


def client(endpoint):
    return boto3.client(
        "sqs",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


def main():
    action, endpoint = sys.argv[1], sys.argv[2]
    sqs = client(endpoint)
    if action == "create":
        name = sys.argv[3]
        attributes = dict(a.split("=", 1) for a in sys.argv[4:])
        if name.endswith(".fifo"):
            attributes["FifoQueue"] = "true"
        print(sqs.create_queue(QueueName=name, Attributes=attributes)["QueueUrl"])
    elif action == "read":
        url = sys.argv[3]
        out, empty = [], 0
        while empty < 3:
            got = sqs.receive_message(
                QueueUrl=url,
                MaxNumberOfMessages=10,
                MessageAttributeNames=["All"],
                MessageSystemAttributeNames=["All"],
                VisibilityTimeout=300,
                WaitTimeSeconds=0,
            ).get("Messages", [])
            if not got:
                empty += 1
                continue
            empty = 0
            for m in got:
                attributes = {}
                for k, v in m.get("MessageAttributes", {}).items():
                    if v["DataType"].startswith("Binary"):
                        attributes[k] = {"binary": base64.b64encode(v["BinaryValue"]).decode()}
                    else:
                        attributes[k] = v["StringValue"]
                system = m.get("Attributes", {})
                out.append(
                    {
                        "body": m["Body"],
                        "message_id": m["MessageId"],
                        "attributes": attributes,
                        "group": system.get("MessageGroupId"),
                        "dedup": system.get("MessageDeduplicationId"),
                        "sequence": system.get("SequenceNumber"),
                    }
                )
            sqs.delete_message_batch(
                QueueUrl=url,
                Entries=[
                    {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]}
                    for i, m in enumerate(got)
                ],
            )
        json.dump(out, sys.stdout)
    elif action == "count":
        attributes = sqs.get_queue_attributes(
            QueueUrl=sys.argv[3], AttributeNames=["ApproximateNumberOfMessages"]
        )["Attributes"]
        print(attributes["ApproximateNumberOfMessages"])
    else:
        sys.exit(f"unknown action {action}")


if __name__ == "__main__":
    main()
