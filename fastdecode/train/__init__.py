"""Training inside fastdecode: drafter heads distilled from the target itself (`fastdecode train-drafter`)."""
