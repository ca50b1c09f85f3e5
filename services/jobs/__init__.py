"""Jobs stage: counts each job's final requests in MariaDB and emits one completion per job, with its report."""
