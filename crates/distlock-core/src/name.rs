//! Lock names.
//!
//! For the `distlock` CLI, which checks a name before it connects; [`crate::Locks::lock`] applies the same
//! rules.

use crate::error::{Error, ErrorKind, Result};

/// The longest lock name accepted, in bytes.
pub const MAX_NAME_BYTES: usize = 1024;

/// Checks the rules every backend shares: non-empty UTF-8 of at most [`MAX_NAME_BYTES`] bytes with no
/// NUL. Backends map the name onto their medium themselves (raw key, escaped file name, hash).
///
/// ```
/// use distlock_core::name::validate;
/// assert!(validate("orders/42").is_ok());
/// assert!(validate("").is_err());
/// assert!(validate(&"x".repeat(2048)).is_err());
/// ```
pub fn validate(name: &str) -> Result<()> {
    let problem = if name.is_empty() {
        "a lock name must not be empty".to_string()
    } else if name.len() > MAX_NAME_BYTES {
        format!(
            "a lock name must be at most {MAX_NAME_BYTES} bytes, this one has {} (starts {:?})",
            name.len(),
            name.chars().take(32).collect::<String>()
        )
    } else if name.contains('\0') {
        "a lock name must not contain NUL".to_string()
    } else {
        return Ok(());
    };
    Err(Error::new(ErrorKind::InvalidName, problem))
}
