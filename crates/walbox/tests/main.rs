//! Integration tests of the `walbox` binary against a real Postgres.

mod bad_inputs;
mod mapping;
mod migrate;
mod run;
