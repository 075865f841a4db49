"""What several recipes build the same way: the next-token job, the preference job, on-policy sampling."""
