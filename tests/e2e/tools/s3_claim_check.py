"""An independent S3 client (boto3) for the claim-check test.

    s3_claim_check.py create ENDPOINT BUCKET
    s3_claim_check.py verify ENDPOINT BUCKET < pointers.json

`verify` reads [{"url", "sha256", "size", "n"}, ...] (what walbox's records
carry) and, for each, fetches the object, checks its SHA-256 and size and
that it is event n's payload; it prints "verified N" or fails.
"""

import hashlib
import json
import sys

import boto3


def main():
    action, endpoint, bucket = sys.argv[1:4]
    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
    )
    if action == "create":
        s3.create_bucket(Bucket=bucket)
        print("created")
        return
    prefix = f"s3://{bucket}/"
    pointers = json.load(sys.stdin)
    for p in pointers:
        url = p["url"]
        if not url.startswith(prefix):
            sys.exit(f"{url}: not in bucket {bucket}")
        body = s3.get_object(Bucket=bucket, Key=url[len(prefix):])["Body"].read()
        digest = hashlib.sha256(body).hexdigest()
        if digest != p["sha256"]:
            sys.exit(f"{url}: sha256 {digest}, the record says {p['sha256']}")
        if len(body) != p["size"]:
            sys.exit(f"{url}: {len(body)} bytes, the record says {p['size']}")
        n = json.loads(body)["n"]
        if n != p["n"]:
            sys.exit(f"{url}: holds event {n}, expected {p['n']}")
    print(f"verified {len(pointers)}")


if __name__ == "__main__":
    main()
