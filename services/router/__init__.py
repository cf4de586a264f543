"""The router: knows every worker, decides where each request runs."""
