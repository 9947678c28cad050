-- docker-compose.yml: the accounts the demo producer's payments deduct from (ACC-0 .. ACC-99).
INSERT INTO accounts (account_id, balance)
SELECT 'ACC-' || g, 1000000.00 FROM generate_series(0, 99) g
ON CONFLICT (account_id) DO NOTHING;
