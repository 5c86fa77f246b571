"""Online drafter co-training pieces shared by the verl integration and the drift harness:
settings (`config`), capture during the RL step (`capture`), the drafter session (`session`),
versioned publishing (`publish`) and the `collect_only` Feature Store sink (`sink`)."""
