//! Resource-side fencing on PostgreSQL: the classic version-column check, generalised to distlock's
//! fencing tokens, so that **the database itself refuses a stale holder's write**.
//!
//! The protected row carries a `bigint` column (say `fence_token`, `NOT NULL DEFAULT 0`) holding the
//! highest token that has written it. A fenced update is
//!
//! ```sql
//! UPDATE <table> SET <fence column> = $1, <your SET list> WHERE (<your filter>) AND <fence column> <= $1
//! ```
//!
//! with the holder's token as `$1` and your parameters from `$2` on. A holder whose lock was taken over
//! (paused past its lease, cut off) carries a lower token than the one who wrote since, and its update
//! matches no row: [`Fenced::Refused`]. A token equal to the stored one passes, so one holder may write
//! many times. The check and the write are one statement, so no other write slips in between.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let server = distlock_testkit::postgres::PostgresServer::start()?;
//! # let url = server.url();
//! use distlock_sql::postgres::fence::{execute_fenced, Fenced, FencedUpdate};
//! use distlock_sql::postgres::tokio_postgres;
//! use distlock_core::FencingToken;
//!
//! let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await?;
//! tokio::spawn(connection);
//! client.batch_execute("CREATE TABLE accounts (id int PRIMARY KEY, balance int NOT NULL, \
//!                       fence_token bigint NOT NULL DEFAULT 0); \
//!                       INSERT INTO accounts (id, balance) VALUES (1, 100)").await?;
//! let update = FencedUpdate::new("accounts", "fence_token", "balance = balance + $2", "id = $3");
//!
//! // The holder with token 7 writes; a newer holder (token 8) writes; the old one comes back late.
//! let applied = execute_fenced(&client, &update, FencingToken::new(7), &[&10, &1]).await?;
//! assert_eq!(applied, Fenced::Applied(1));
//! execute_fenced(&client, &update, FencingToken::new(8), &[&5, &1]).await?;
//! let late = execute_fenced(&client, &update, FencingToken::new(7), &[&1000, &1]).await?;
//! assert_eq!(late, Fenced::Refused);
//! let balance: i32 = client.query_one("SELECT balance FROM accounts WHERE id = 1", &[]).await?.get(0);
//! assert_eq!(balance, 115);
//! # Ok(()) }
//! ```

use distlock_core::FencingToken;
use tokio_postgres::types::ToSql;
use tokio_postgres::GenericClient;

/// A fenced `UPDATE`: which table, which fence column, your `SET` list and your filter. The fragments
/// are SQL written by you (never user input); your parameters are numbered from `$2`, `$1` being the
/// token.
///
/// Made once, then run by each holder with its own token ([`execute_fenced`]):
///
/// ```
/// use distlock_sql::postgres::fence::FencedUpdate;
///
/// let credit = FencedUpdate::new("accounts", "fence_token", "balance = balance + $2", "id = $3");
/// assert_eq!(
///     credit.sql(),
///     "UPDATE accounts SET fence_token = $1, balance = balance + $2 \
///      WHERE (id = $3) AND fence_token <= $1"
/// );
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FencedUpdate {
    sql: String,
}

impl FencedUpdate {
    /// `UPDATE table SET fence_column = $1, set WHERE (filter) AND fence_column <= $1`.
    pub fn new(table: &str, fence_column: &str, set: &str, filter: &str) -> Self {
        Self {
            sql: format!(
                "UPDATE {table} SET {fence_column} = $1, {set} WHERE ({filter}) AND {fence_column} <= $1"
            ),
        }
    }

    /// The statement as sent.
    pub fn sql(&self) -> &str {
        &self.sql
    }
}

/// What a fenced update did.
///
/// A refusal is no error: it says the lock has passed to a newer holder, so this one must stop
/// writing, not retry:
///
/// ```
/// use distlock_sql::postgres::fence::Fenced;
///
/// fn still_ours(outcome: Fenced) -> Result<u64, &'static str> {
///     match outcome {
///         Fenced::Applied(rows) => Ok(rows),
///         _ => Err("a newer holder has written: stop"),
///     }
/// }
/// assert_eq!(still_ours(Fenced::Applied(1)), Ok(1));
/// assert!(still_ours(Fenced::Refused).is_err());
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fenced {
    /// The token was current: this many rows were written.
    Applied(u64),
    /// No row was written: a newer token has written the row (or the filter matched nothing).
    Refused,
}

/// Runs `update` with `token` as `$1` and `params` as `$2…`, on a client or inside a transaction.
///
/// # Errors
/// The driver's error when the statement fails (a token beyond `i64::MAX` is refused as a parameter
/// error).
pub async fn execute_fenced(
    client: &impl GenericClient,
    update: &FencedUpdate,
    token: FencingToken,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Fenced, tokio_postgres::Error> {
    // Never clamped: two tokens beyond `i64::MAX` would both become `i64::MAX`, and the lower one
    // would pass. Such a token fails as a parameter (the statement is not sent).
    let token = TokenParam(token.get());
    let mut all: Vec<&(dyn ToSql + Sync)> = Vec::with_capacity(params.len() + 1);
    all.push(&token);
    all.extend_from_slice(params);
    let rows = client.execute(update.sql(), &all).await?;
    Ok(if rows == 0 {
        Fenced::Refused
    } else {
        Fenced::Applied(rows)
    })
}

/// The token as a `bigint` parameter; a token beyond `i64::MAX` is a serialization error.
#[derive(Debug)]
struct TokenParam(u64);

impl ToSql for TokenParam {
    fn to_sql(
        &self,
        ty: &tokio_postgres::types::Type,
        out: &mut bytes::BytesMut,
    ) -> Result<tokio_postgres::types::IsNull, Box<dyn std::error::Error + Sync + Send>> {
        let token = i64::try_from(self.0).map_err(|_| {
            format!(
                "fencing token {} is beyond bigint's range (i64::MAX); a fence column cannot hold it",
                self.0
            )
        })?;
        token.to_sql(ty, out)
    }

    fn accepts(ty: &tokio_postgres::types::Type) -> bool {
        <i64 as ToSql>::accepts(ty)
    }

    tokio_postgres::types::to_sql_checked!();
}
