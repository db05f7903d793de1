//! Whether an outbox table fits its mapping, read from the catalog before
//! its rows stream: the mapped columns exist, and the payload column has a
//! type the format can publish. The test is the one the relay applies to
//! each Relation message ([`OutboxMapping::resolve_with`]), so a table
//! refused here is one whose every row would be unmappable.

use std::collections::HashMap;

use pgoutput_decoder::RelationBody;
use slot_manager::{check_table, domain_base_types, Error, TableName};
use tokio_postgres::Client;

use crate::bookkeeping::backfills::columns;
use crate::mapping::OutboxMapping;

/// Refuses `table` when its mapping (its own under `[mapping.tables]`, else
/// `mapping`) does not fit it, naming the table and what is wrong; else
/// gives the base type of each domain among its columns, which the check
/// read (what the relay resolves Relation messages with).
pub async fn check_fits(
    client: &Client,
    table: &TableName,
    mapping: &OutboxMapping,
) -> Result<HashMap<u32, u32>, Error> {
    let refused = |e: crate::mapping::MapError| Error::Precondition(e.to_string());
    let own = mapping
        .for_table(table.schema(), table.name())
        .map_err(refused)?;
    let wanted = own.required_columns();
    check_table(client, table, &wanted).await?;
    let found = columns(client, table, &wanted).await?;
    let domains = domain_base_types(client, table).await?;
    let relation = RelationBody::from_catalog(0, table.schema(), table.name(), found);
    mapping.resolve_with(&relation, &domains).map_err(refused)?;
    Ok(domains)
}
