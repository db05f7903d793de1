//! End-to-end tests of the `walbox` binary as operators run it: real
//! Postgres, a Kafka broker (the MockCluster, or Apache Kafka in `scripts/test`'s
//! second pass), signals, kill -9, restarts.

mod apache_kafka;
mod audit;
mod backfill;
mod backlog;
mod bad_inputs;
mod claim_check;
mod config;
mod debezium;
mod doctor;
mod drift;
mod exactly_once;
mod failover;
mod formats;
mod logs;
mod lost_slot;
mod many_tables;
mod messages;
mod migrate;
mod msk_iam;
mod nats;
mod privileges;
mod prometheus;
mod quarantine;
mod rabbitmq;
mod receipts;
mod republish;
mod retention;
mod run;
mod schema_registry;
mod secrets;
mod secured_kafka;
mod shards;
mod spans;
mod sqs;
mod support;
mod topics;
mod webhook;
