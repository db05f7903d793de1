//! Integration tests of the walbox library against a real Postgres. The
//! process-level tests of the `walbox` binary are the workspace's top-level
//! `tests/` crate (`walbox-e2e`).

mod mapping;
