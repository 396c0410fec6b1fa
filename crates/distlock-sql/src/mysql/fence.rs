//! Resource-side fencing for MariaDB / MySQL (not built yet).
