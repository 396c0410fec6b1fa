//! Resource-side fencing on MariaDB / MySQL: the application's own `UPDATE`, guarded by the lock's
//! fencing token, so that a stale holder's write (one whose lock has since passed to a holder with a
//! higher token) is refused by the database itself.
//!
//! It is the classic version-column check, generalised: the guarded rows carry a `fence_token`
//! column (`BIGINT UNSIGNED NOT NULL DEFAULT 0`, see [`add_column_sql`]); a write sets it to the
//! writer's token and applies only where it is not higher already:
//!
//! ```text
//! UPDATE <table> SET <set>, fence_token = <token> WHERE (<filter>) AND fence_token <= <token>
//! ```
//!
//! A holder with token 7 that wrote once makes every later write with a token below 7 a no-op, reported
//! as [`FenceOutcome::Refused`]; equal tokens pass (the same holder writes again).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let server = distlock_testkit::mariadb::MariaDbServer::start()?;
//! # let url = server.url();
//! use distlock_sql::mysql::fence::{FenceOutcome, FencedUpdate};
//! use mysql_async::prelude::Queryable as _;
//!
//! let locks = distlock_core::Locks::new(distlock_sql::mysql::connect(&url).await?);
//! let mut db = mysql_async::Conn::from_url(url.as_str()).await?;
//! db.query_drop("CREATE TABLE accounts (id INT PRIMARY KEY, balance INT)").await?;
//! db.query_drop(distlock_sql::mysql::fence::add_column_sql("accounts")).await?;
//! db.query_drop("INSERT INTO accounts (id, balance) VALUES (1, 100)").await?;
//!
//! let debit = FencedUpdate::new("accounts", "balance = balance - ?", "id = ?");
//! let guard = locks.lock("account-1")?.acquire().await?;
//! let token = guard.token().expect("SQL locks mint tokens");
//! assert_eq!(debit.execute(&mut db, (10, 1), token).await?, FenceOutcome::Applied { rows: 1 });
//!
//! // A holder whose lock has passed on writes with an older token: the database refuses it.
//! let stale = distlock_core::FencingToken::new(token.get() - 1);
//! assert_eq!(debit.execute(&mut db, (10, 1), stale).await?, FenceOutcome::Refused);
//! let balance: Option<i32> = db.query_first("SELECT balance FROM accounts WHERE id = 1").await?;
//! assert_eq!(balance, Some(90));
//! # guard.release().await?;
//! # Ok(()) }
//! ```

use distlock_core::{Error, ErrorKind, FencingToken};
use mysql_async::prelude::Queryable as _;
use mysql_async::{Conn, Params};

/// The default name of the guarded rows' token column.
pub const DEFAULT_COLUMN: &str = "fence_token";

/// `ALTER TABLE <table> ADD COLUMN fence_token BIGINT UNSIGNED NOT NULL DEFAULT 0`: makes a table's rows
/// guardable (existing rows start at 0, below every token).
pub fn add_column_sql(table: &str) -> String {
    format!("ALTER TABLE {table} ADD COLUMN {DEFAULT_COLUMN} BIGINT UNSIGNED NOT NULL DEFAULT 0")
}

/// What a guarded write did.
///
/// A refusal is no error: it says the lock has passed to a newer holder, so this one must stop
/// writing, not retry:
///
/// ```
/// use distlock_sql::mysql::fence::FenceOutcome;
///
/// fn still_ours(outcome: FenceOutcome) -> Result<u64, &'static str> {
///     match outcome {
///         FenceOutcome::Applied { rows } => Ok(rows),
///         _ => Err("a newer holder has written: stop"),
///     }
/// }
/// assert_eq!(still_ours(FenceOutcome::Applied { rows: 1 }), Ok(1));
/// assert!(still_ours(FenceOutcome::Refused).is_err());
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceOutcome {
    /// The write applied to `rows` rows (matched rows, whether or not their values changed).
    Applied {
        /// Rows matched by the filter whose token was not higher.
        rows: u64,
    },
    /// No row matched with a token at or below the writer's: a newer holder has written (or the filter
    /// matched nothing).
    Refused,
}

/// An application `UPDATE` guarded by a fencing token (see the [module docs](self)).
///
/// Made once, then executed by each holder with its own token; the token column may have another
/// name than [`DEFAULT_COLUMN`] (an existing version column):
///
/// ```
/// use distlock_core::FencingToken;
/// use distlock_sql::mysql::fence::FencedUpdate;
///
/// let debit = FencedUpdate::new("accounts", "balance = balance - ?", "id = ?").with_column("version");
/// assert_eq!(
///     debit.sql(FencingToken::new(42)),
///     "UPDATE accounts SET balance = balance - ?, version = 42 WHERE (id = ?) AND version <= 42"
/// );
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FencedUpdate {
    table: String,
    set: String,
    filter: String,
    column: String,
}

impl FencedUpdate {
    /// `UPDATE table SET set … WHERE (filter) …`: `set` and `filter` are the application's SQL, with `?`
    /// placeholders bound, in that order, by [`execute`](Self::execute)'s params.
    pub fn new(
        table: impl Into<String>,
        set: impl Into<String>,
        filter: impl Into<String>,
    ) -> Self {
        Self {
            table: table.into(),
            set: set.into(),
            filter: filter.into(),
            column: DEFAULT_COLUMN.into(),
        }
    }

    /// Uses another token column than [`DEFAULT_COLUMN`].
    pub fn with_column(mut self, column: impl Into<String>) -> Self {
        self.column = column.into();
        self
    }

    /// The statement for `token` (the token is a number, written into the SQL).
    ///
    /// ```
    /// use distlock_sql::mysql::fence::FencedUpdate;
    /// let u = FencedUpdate::new("t", "v = ?", "id = ?");
    /// assert_eq!(u.sql(distlock_core::FencingToken::new(7)),
    ///     "UPDATE t SET v = ?, fence_token = 7 WHERE (id = ?) AND fence_token <= 7");
    /// ```
    pub fn sql(&self, token: FencingToken) -> String {
        let (table, set, filter, column, t) = (
            &self.table,
            &self.set,
            &self.filter,
            &self.column,
            token.get(),
        );
        format!("UPDATE {table} SET {set}, {column} = {t} WHERE ({filter}) AND {column} <= {t}")
    }

    /// Runs the guarded write on `conn` (the application's own connection, in its own transaction if it
    /// has one open). Rows are counted as matched, from the server's info line, so a write that sets the
    /// values they already have still counts as applied.
    pub async fn execute(
        &self,
        conn: &mut Conn,
        params: impl Into<Params> + Send,
        token: FencingToken,
    ) -> distlock_core::Result<FenceOutcome> {
        conn.exec_drop(self.sql(token), params).await.map_err(|e| {
            Error::new(ErrorKind::Unavailable, format!("fenced update failed: {e}"))
                .with_backend(super::KIND)
                .with_source(e)
        })?;
        let rows = matched_rows(&conn.info()).unwrap_or_else(|| conn.affected_rows());
        Ok(if rows > 0 {
            FenceOutcome::Applied { rows }
        } else {
            FenceOutcome::Refused
        })
    }
}

/// `Rows matched: 1  Changed: 0  Warnings: 0` → 1.
fn matched_rows(info: &str) -> Option<u64> {
    let rest = info.split("Rows matched:").nth(1)?;
    rest.split_whitespace().next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_info_line() {
        assert_eq!(
            matched_rows("Rows matched: 3  Changed: 0  Warnings: 0"),
            Some(3)
        );
        assert_eq!(matched_rows(""), None);
    }
}
