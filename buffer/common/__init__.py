"""Small building blocks every part of millpond uses: an injectable clock, capped jittered
backoff, ULID batch names and thread-safe counters. No IO beyond reading the time."""
