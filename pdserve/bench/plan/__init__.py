"""`pdserve plan`: measure an engine (profile), predict deployments by simulation over
the profile (recommend), and check the prediction against a measured run (check)."""
