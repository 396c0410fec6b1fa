//! The PostgreSQL backend (`postgres://`, `postgresql://`), driver tokio-postgres.
