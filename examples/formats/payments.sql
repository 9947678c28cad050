-- Business tables of the example pipeline pipelines/payments.toml: a payment deduction keyed by order id.
-- Apply once with: psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -f pipelines/payments.sql
-- (idemflow never creates business tables; `idemflow migrate` creates only its own `idemflow` schema.)

CREATE TABLE IF NOT EXISTS accounts (
    account_id  text    PRIMARY KEY,
    balance     numeric NOT NULL
);

CREATE TABLE IF NOT EXISTS payments (
    order_id    text        PRIMARY KEY,
    account_id  text        NOT NULL REFERENCES accounts,
    amount      numeric     NOT NULL CHECK (amount > 0),
    currency    text        NOT NULL,
    paid_at     timestamptz,
    details     jsonb,
    applied_at  timestamptz NOT NULL DEFAULT now()
);
