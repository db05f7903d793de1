//! Tests that prove the harness is real: Postgres with logical decoding,
//! the outbox migrations, a broker that round-trips keyed messages with
//! headers, and servers that never outlive the test process.

mod harness;
mod kafka_smoke;
mod pg_smoke;
