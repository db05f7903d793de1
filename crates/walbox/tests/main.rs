//! Integration tests of the `walbox` binary against a real Postgres.

mod mapping;
mod migrate;
mod run;
