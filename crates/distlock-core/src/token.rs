//! Fencing tokens.

use std::fmt;

/// A number that strictly increases each time the lock changes hands, so a resource that remembers the
/// highest token it has seen can reject a superseded holder's write.
///
/// A reentrant acquire returns the token of the hold it joins. Where the engine can mint one is said by
/// [`Capabilities::fencing`](crate::Capabilities::fencing).
///
/// ```
/// use distlock_core::FencingToken;
/// assert!(FencingToken::new(7) > FencingToken::new(6));
/// assert_eq!(FencingToken::new(7).to_string(), "7");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(u64);

impl FencingToken {
    /// Wraps a token value minted by a backend.
    pub const fn new(value: u64) -> Self {
        Self(value)
    }

    /// The token's value.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl From<FencingToken> for u64 {
    fn from(token: FencingToken) -> u64 {
        token.0
    }
}
