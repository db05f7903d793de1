//! End-to-end tests of walbox live in `e2e/`; this library is empty.
