//! Where the relay sends: a [`Destination`] of sink-core, and in
//! exactly-once mode its transactions ([`Ends`]).

use bytes::Bytes;
use sink_core::tail::TailReader;
use sink_core::{Admission, Permit, Record, TxnError};
pub use sink_core::{Deliveries, Destination, Transactional};

use super::Token;

/// The relay's sending end: where records go, and the transactions they
/// are written in when delivery is exactly-once (the same broker client;
/// `None`: at least once).
pub struct Ends<'a, D, X> {
    /// Where records go.
    pub destination: &'a D,
    /// Their transactions, in exactly-once mode.
    pub transactions: Option<&'a X>,
    /// What reads the broker back at a start (`skip_delivered`); `None`:
    /// the broker cannot be read so, or the setting is off.
    pub tails: Option<&'a dyn TailReader>,
}

impl<'a, D> Ends<'a, D, NoTransactions> {
    /// At least once, on a destination without transactions.
    pub fn at_least_once(destination: &'a D) -> Self {
        Ends {
            destination,
            transactions: None,
            tails: None,
        }
    }
}

/// The transactions of a destination that has none: a type with no value,
/// so `Ends::transactions` of an at-least-once destination is always
/// `None`, and no call answers "unsupported".
#[derive(Debug)]
pub enum NoTransactions {}

impl Destination<Token> for NoTransactions {
    fn admission(&self) -> &Admission {
        match *self {}
    }

    async fn send(&self, _: Permit, _: Record<Token>) {
        match *self {}
    }
}

impl Transactional<Token> for NoTransactions {
    async fn init(&self) -> Result<(), TxnError> {
        match *self {}
    }

    async fn last_committed(&self, _: &str, _: &str) -> Result<Option<Bytes>, String> {
        match *self {}
    }

    fn begin(&self) -> Result<(), TxnError> {
        match *self {}
    }

    async fn commit(&self) -> Result<(), TxnError> {
        match *self {}
    }

    async fn abort(&self) -> Result<(), TxnError> {
        match *self {}
    }
}
