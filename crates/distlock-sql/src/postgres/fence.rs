//! Resource-side fencing for PostgreSQL (to be written).
