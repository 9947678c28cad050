-- Business tables of the MySQL/MariaDB example pipeline examples/mysql/payments.toml: a payment deduction keyed by
-- order id. Apply once with:
--   mariadb -h HOST -u USER -p DATABASE < examples/mysql/payments.sql      (or: mysql ... < examples/mysql/payments.sql)
-- (idemflow never creates business tables; `idemflow migrate` creates only its own idemflow_* tables.)
-- utf8mb4 throughout: a utf8mb3 column cannot hold every character (the table form refuses to write to one; in the
-- SQL form a record with such a character is dead-lettered with MySQL error 1366).
-- Amounts are DECIMAL(18,2): MySQL rounds digits beyond a column's scale (a note, not an error, even in strict
-- mode), so declare the scale your amounts have.

CREATE TABLE IF NOT EXISTS accounts (
    account_id  VARCHAR(64)    NOT NULL PRIMARY KEY,
    balance     DECIMAL(18, 2) NOT NULL
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

CREATE TABLE IF NOT EXISTS payments (
    order_id    VARCHAR(255)   NOT NULL PRIMARY KEY,
    account_id  VARCHAR(64)    NOT NULL,
    amount      DECIMAL(18, 2) NOT NULL CHECK (amount > 0),
    currency    CHAR(3)        NOT NULL,
    paid_at     TIMESTAMP(6)   NULL,
    details     JSON           NULL,
    applied_at  TIMESTAMP(6)   NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    CONSTRAINT payments_account FOREIGN KEY (account_id) REFERENCES accounts (account_id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
