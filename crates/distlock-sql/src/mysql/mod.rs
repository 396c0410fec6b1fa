//! The MySQL / MariaDB backend (`mysql://`, `mariadb://`): filled in by the MariaDB half of issue 11.
